"""The process and the machine it runs on: the torch device, llama.cpp's process-wide
setup, memory measurement, owner tags for what a run leaves behind, the bundled model and
the HTTP key check, and the small C libraries built for this CPU. Imports nothing of
retrograd but errors."""
