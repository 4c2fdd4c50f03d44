"""Data bundled with shardplan: ``corpus.txt``, the demo's training text.

``corpus.txt`` is plain ASCII text, read as byte tokens by ``shardplan demo``.
Every passage in it is from a work in the public domain (published well over a
century ago): the King James Version of the Bible (1611), Shakespeare's sonnets
(1609) and plays, and Aesop's fables in the manner of the old English
translations. The passages were transcribed for shardplan from memory, not
copied from a particular edition, and may differ from printed texts in small
ways; that does not matter for the demo, which only needs real English text.
"""
