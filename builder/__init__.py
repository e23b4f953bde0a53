"""ifb.builder: turns a model source into a compiled engine folder with its limits baked in."""
