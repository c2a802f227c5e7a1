"""gates/evidence/: the release's evidence bundle: the manifest, its signature, and verify."""
