"""Contracts at the bottom of the package: the one clock, and the small interfaces between
the communication choke point and the recorder and simulated link above it."""
