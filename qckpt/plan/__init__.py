"""``qckpt plan``: every rank's memory and reads, predicted from metadata alone.

Nothing here allocates a weight or reads tensor data: the model is built on the meta device and
sharded by the commands' own sharders (``qckpt.pipeline.plan`` runs that order), quantized
parameters are sized by each format's own shape rules (:mod:`qckpt.plan.fields`), and reads are
counted from the checkpoint's metadata (:mod:`qckpt.plan.reads`). :mod:`qckpt.plan.predict`
turns a rank's tensors into the figures each command reports, :mod:`qckpt.plan.layouts` lists
the layouts worth trying and picks the smallest that fits. :mod:`qckpt.plan.schemes` assigns
a recipe's schemes to the model's linears (refusing what no export can be made of) and
figures each scheme's linears, amaxes and export bytes from the scheme itself.
"""
