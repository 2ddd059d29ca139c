# On PYTHONPATH, this directory makes `import numpy` fail as it does where numpy is not
# installed (ModuleNotFoundError, which torch catches): torch 2.x runs without numpy, and
# the venv of scripts/fetch-torch.sh has it only because Lightning and Accelerate need it.
# tests/torches/mod.rs puts it on the ranks' PYTHONPATH for the "without numpy" variants.
raise ModuleNotFoundError("No module named 'numpy' (hidden by meshd's tests/python/without_numpy)", name="numpy")
