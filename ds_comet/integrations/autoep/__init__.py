"""ds_comet under DeepSpeed AutoEP: ``CometAutoEPMoELayer``."""
