"""The CPU demos and their local assets (nothing is downloaded): ``first_letter`` (one-token answers,
``make run``) and ``digits`` (several tokens ending with EOS, ``make run-async``)."""
