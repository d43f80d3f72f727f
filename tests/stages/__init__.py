"""The stages of a call: scatter, replicate, parallel apply, gather, and their type rules."""
