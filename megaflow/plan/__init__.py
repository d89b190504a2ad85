"""``megaflow plan``: GPU memory per rank (``memory``) from the DiT's dimensions and coefficients (``dit``);
standard library only."""
