"""Commands that are not training: data preparation (``subnetdp prepare-text``).

A command wing: it stands on ``core`` and the plugins it prepares data for, and no other wing
imports it.
"""
