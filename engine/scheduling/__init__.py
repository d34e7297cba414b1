"""Scheduling: the request queue, the scheduler's state and step, and its plain output value."""
