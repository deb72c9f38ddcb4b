"""Critics: step critic, trajectory critic channels and their consensus, programmatic checkers."""
