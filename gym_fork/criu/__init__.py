"""CRIU for gym_fork: finding and checking it (status), driving it with a timeout on every call
(client), reading what images need to be restored (images), and running it without root (userns)."""
