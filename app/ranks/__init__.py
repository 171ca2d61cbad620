"""Every rank: its start-up (join, load, parallelize, engines), the lockstep service, replica groups, stopping."""
