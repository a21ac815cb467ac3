"""DFlash drafter training fed by the dflash-loader daemon."""
