"""The demo run (``edge-agent demo``): its load, spoken commands, live view and report."""
