"""Generators as Ray actors: the actor (`generator`, its engine's thread in `decode_loop`), the
pool the actor loop sees (`pool`: a facade over the actors' records in `members`, the weight
`updates` and the `restarts`), and which devices each gets (`placement`)."""
