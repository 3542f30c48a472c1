"""Who holds the memory: allocation sites, modules, and what the peak was made of."""
