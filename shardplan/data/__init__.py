"""Data bundled with shardplan.

``corpus.txt``: about 200 KB of plain ASCII English, the training text of
``shardplan demo`` (read as byte tokens). Every passage is from a work in the
public domain, published long before 1929:

- the King James Version of the Bible (1611): passages of Genesis, Exodus,
  Ruth, Job, the Psalms, Proverbs, Ecclesiastes, the Song of Solomon, Isaiah,
  Jonah, Micah, Matthew, Luke, John, 1 Corinthians and Revelation;
- William Shakespeare (1564-1616): sonnets from the 1609 quarto, speeches and
  songs from the plays (modern spelling);
- Aesop's fables in the wording of English translations published in 1867
  (George Fyler Townsend), 1894 (Joseph Jacobs) and 1919 (*The Aesop for
  Children*).

The passages were transcribed for shardplan from memory, not copied from a
particular edition or file, and may differ from the printed texts in small
ways; that does not matter here, where only real English text is needed.
Read it with ``importlib.resources.files("shardplan.data") / "corpus.txt"``.
"""
