"""Tiering: the KV tiers below the device pool (host, disk, Redis), codecs, and the tier manager."""
