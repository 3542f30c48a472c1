"""Rendering: terminal text and the HTML report. Only this package imports jinja2."""
