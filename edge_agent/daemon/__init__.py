"""The daemon: the app that composes the parts (``app``), its SIGHUP reload, the fleet's
command target, what it serves for ``meta``, its start-up summary and its state lock.
"""
