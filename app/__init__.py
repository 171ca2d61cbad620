"""What a person touches: CLI, launch script, rank-0 Gradio UI, batch runner, lockstep service."""
