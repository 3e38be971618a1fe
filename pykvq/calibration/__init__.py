"""What `pykvq calibrate` chooses from measurements, each choice in its own module: per-layer widths for a budget
(``allocation``, from ``attention_sensitivity``), SKVQ clip ratios (``clip_ratios``), Hadamard rotation per layer
(``rotation``) and the fp16 window (``window_choice``). numpy only; the model runs stay in pykvq.commands.calibrate."""
