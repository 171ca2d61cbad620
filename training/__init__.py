"""Training of the embedded tiny models on procedural shapes (see training/__main__.py for the command)."""
