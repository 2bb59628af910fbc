import torch

# The test models are tiny: their forwards are dispatch-bound, and intra-op threads only add
# synchronisation overhead (severe when the machine's two cores are shared).
torch.set_num_threads(1)
