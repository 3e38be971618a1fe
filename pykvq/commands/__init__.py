"""The ``pykvq`` command line: one module per subcommand (run, info, perplexity, calibrate, inspect) and the
parser that joins them with ``convert`` (``pykvq.convert``)."""
