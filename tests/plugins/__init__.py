"""Objectives written as a user writes them, outside the paratrain package (loss.name = 'tests.plugins.MODULE:NAME')."""
