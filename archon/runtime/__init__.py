"""Process hooks of a training run: kill-and-resume drill points (``drill``) and the startup
objects kept out of the garbage collector's way (``gc_freeze``)."""
