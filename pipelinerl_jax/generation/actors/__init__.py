"""Generators as Ray actors: the actor (`generator`), the pool the actor loop sees (`pool`), and
which devices each gets (`placement`)."""
