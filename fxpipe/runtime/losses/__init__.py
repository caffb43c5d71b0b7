"""Losses and the model's own loss: how the micro-batches' losses make one step's loss and gradients.

:mod:`~fxpipe.runtime.losses.losses` weighs them (``reduction="mean"``, ``"sum"``, ``"token"``);
:mod:`~fxpipe.runtime.losses.auto_loss` is ``reduction="auto"``, exact or refused, with
:mod:`~fxpipe.runtime.losses.mean_calls` (an ``F.cross_entropy``/``F.nll_loss`` mean made a sum and a count) and
:mod:`~fxpipe.runtime.losses.sample_mean_check` (is any other loss a mean over samples);
:mod:`~fxpipe.runtime.losses.model_loss` trains on the loss the model computes itself.
"""
