"""Plots: one function per figure. Only this package imports matplotlib."""
