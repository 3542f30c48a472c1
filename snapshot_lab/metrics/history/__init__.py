"""Memory over time: the series rebuilt from the trace, chosen moments, training iterations and allocation lifetimes."""
