"""A job file run end to end: config, planning pass, local / Ray execution, reports."""
