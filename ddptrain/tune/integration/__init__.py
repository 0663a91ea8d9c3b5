"""Integrations of the sweep layer with ddptrain's trainers."""
