"""Training memory of SwinIR, the ViT forecaster and SC22's 3-D U-Net: an analytic estimate, and the measurements
that check it; of any other model: a traced one.

The estimate adds up, per rank, ``total = params + grads + optimizer + activations + temporary``, where the
activations are written out per layer following each model's structure; the measurements count the same
quantities in a real (or fake-tensor) training step. Import from the modules:

* :mod:`utils.memory.shapes` — what the memory of each model depends on, read from the config
  (:class:`SwinIRShape`, :class:`ViTShape`, :class:`UNet3DShape`: exact parameter counts, FSDP units, autocast's
  weight copies) and the size of its input (SwinIR's low-res crop or whole field, the ViT's img_size, the U-Net's
  cube);
* :mod:`utils.memory.graphs` — each model's training step as a list of layers in forward order: what each
  saves for backward, typed by the device and the mixed-precision settings, with activation checkpointing's units,
  and the walk that gives the activations held after forward and the temporary peak of the step;
* :mod:`utils.memory.estimate` — :func:`estimate_memory` (what ``estimate_memory.py`` prints): parameters,
  gradients, AdamW state, activations and the temporary peak per rank, alone, under DDP, FSDP2/HSDP and SwinIR's
  domain parallelism; which terms are exact and which approximate;
* :mod:`utils.memory.measure` — the same quantities measured: :class:`SavedTensorBytes` (bytes saved for
  backward), a real training step's peak (CUDA allocator or CPU allocation trace; one rank's under DDP, FSDP2 or
  HSDP), a FakeTensor trace of the saved bytes at any size, and the model, batch and loss train.py would use for a
  config;
* :mod:`utils.memory.traced` — the estimate of any model, by tracing its training step on fake tensors with
  PyTorch's memory trackers (what estimate_memory.py and plan.py use for a model without a hand-written
  description, and with ``--traced`` for any): one device, DDP, FSDP2, HSDP, within 10 % of the measured peak on CPU.

The hand-written descriptions stay where they are more than the trace: activations exact to the byte at any size
in no time (the trace runs every operator of the step: a second or two, for each layout plan.py ranks), the CUDA
attention kernels (the trace runs the CPU's), and tensor, context and pipeline parallelism (refused by the trace).
The trace is closer on the peak itself (-11 % to +8 % of the median measured peak on CPU, one outlier at +22 % in a
run-to-run range that reaches it; the hand-written total -25 % to +39 %): the table is in :mod:`utils.memory.traced`.

shapes ← graphs ← estimate ← measure ← traced (each imports only those to its left); :mod:`utils.memory.vocabulary`,
beside them, is all of utils/ that a hand-written description (models/<name>/memory.py) imports.
"""
