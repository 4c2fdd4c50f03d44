"""Presenters of a Plan: text, HTML, diff, and export to DTensor / Hugging Face plans."""
