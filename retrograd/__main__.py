from retrograd.cli import main

main()
