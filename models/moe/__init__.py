"""Mixture-of-experts layers: the router (``router``); the experts and their dispatch come with issue 50."""
