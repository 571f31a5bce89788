"""Ray-backed services: remote KL transforms and a shared reference-model service."""
