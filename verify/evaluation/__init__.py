"""Evaluation, kept apart from the decode core: per-domain prompts (domains), the run (evaluate), the report."""
