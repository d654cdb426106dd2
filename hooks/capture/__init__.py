"""The capture stage (above parallel and layout): what the model really computed on a sampled step.

``kernels`` reads one attention call (SDPA, a softmax over a product, MHA) into q, k, logits and
masks; ``capture`` arms the hooks for one forward and reduces each call to per-head statistics;
``forwards`` holds the hooks on the attention modules' forwards that the capture and QK-clip's max-logit reader
share; ``compiled`` runs the captured forward eagerly under ``torch.compile``.
"""

from hooks.capture.capture import AttentionCapture
from hooks.capture.compiled import EagerCapture

__all__ = ["AttentionCapture", "EagerCapture"]
