"""The original course's claims C1-C7 and the one rule that turns measurements into a verdict."""
