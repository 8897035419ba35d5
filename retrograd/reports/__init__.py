"""What a run leaves to read: the run report (report.html) from its records, and the phase
timing summary `bin/profile` prints."""
