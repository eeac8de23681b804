"""The Wyoming server for Home Assistant's voice pipeline (``server.WyomingServer``)."""
