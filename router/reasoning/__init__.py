"""Reasoning models in the router (`--reasoning-parser`): splitting the thinking from the answer."""
