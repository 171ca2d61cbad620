"""What a person touches, in three rooms: commands/ (the command line and the launcher), server/ (the rank-0 Gradio
UI, the OpenAI API, the jobs) and ranks/ (every rank's start-up, the lockstep service, replica groups, stopping).
failures.py, outputs.py and stage_times.py, which all three use, stay at the top."""
