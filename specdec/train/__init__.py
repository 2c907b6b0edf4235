"""``specdec train``: self-distilled drafter heads for any target (``data``, ``trainer``)."""
