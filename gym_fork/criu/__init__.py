"""Finding and checking CRIU, and running it without root (user namespaces)."""
