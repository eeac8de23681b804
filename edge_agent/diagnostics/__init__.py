"""What ``doctor`` and ``check-config`` look at: runtimes, devices, audio, the config's problems."""
