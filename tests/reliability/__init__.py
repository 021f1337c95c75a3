"""Faults, restarts, bad input and security: nbdist keeps working and loses nothing."""
