"""The env worker process: its channel to the controller, the env commands it serves, its
command loop and the copy-on-write fork tier.  Imports nothing heavy: every worker starts here."""
