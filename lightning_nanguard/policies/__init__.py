"""Pure decisions: facts in, verdicts out. No Lightning, no tensors on the device."""
