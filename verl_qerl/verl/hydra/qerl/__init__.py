"""The ``qerl`` hydra config group (nvfp4, nvfp4_noaqn, bf16, nf4): YAML only; a package so that setuptools
ships the folder without a namespace-package warning (setup.py's package_data lists the YAML files)."""
