"""The reference trainer behind ``fullshard train``: config, models, data and the loop."""
