# Sourced by the device scripts (run from the repository root on the lent GPU): names the GPU, makes the
# top-level patches/ importable as psr_hf.patches from the source tree, and puts the tree on PYTHONPATH.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import psr_hf.patches" 2>/dev/null || ln -sfn ../patches psr_hf/patches
export PYTHONPATH=$PWD
